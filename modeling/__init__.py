"""Model definitions and builders shared by every role (imports nothing else of fleetrl)."""
