"""Every wire format of fleetrl: gRPC .proto files (and generated stubs) and msgspec records.

This package imports nothing else of fleetrl.
"""
