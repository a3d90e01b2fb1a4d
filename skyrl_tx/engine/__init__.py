"""The engine: claims accepted requests from the database, batches them onto the backend, stores results."""
