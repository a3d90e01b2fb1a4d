"""The OpenAI-compatible endpoint's parts (routes in api/routes/openai_compat.py): bodies, sampling, text, rendering."""
