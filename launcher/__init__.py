"""The launcher: the ``fleetrl`` command line, the demo and Ray launchers, role supervision, the embedded Redis,
the run logger and figures, and the admin API's client.

It starts the roles as processes (or Ray actors) and talks to them only through their command lines, Redis and
the admin API; it imports protos, channels and modeling, never a role package.
"""
