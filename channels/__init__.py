"""Shared infrastructure of the run's Redis channels, below the roles (it imports only protos)."""
