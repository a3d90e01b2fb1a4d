"""Session trace export (GET /api/v1/sessions/{id}/trace_export): the API's request-time ring, the Perfetto writer,
the trace builder and its background jobs."""
