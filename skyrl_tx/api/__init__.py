"""The Tinker HTTP API layer (FastAPI). It never imports skyrl_tx._C."""
