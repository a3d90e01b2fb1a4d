"""The Tinker wire format: the schema the project owns (tinker_wire.proto), its generated module and the codec."""
