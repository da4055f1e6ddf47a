"""fleetrl's client-side packages. ``fleetrl.agent``: the Python SDK of the agent API (protos/agent.proto).

It imports only ``protos`` (and grpc, numpy), so an agent process needs none of the services' code.
"""
