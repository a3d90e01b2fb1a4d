"""schemathesis hooks of tests/api/test_openapi_schemathesis.py (loaded through $SCHEMATHESIS_HOOKS): forward_backward's
protobuf body is sent as the raw bytes generated for it."""

import schemathesis

schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")
