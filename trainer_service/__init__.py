"""Trainer service: consumes trajectory groups from Redis, trains, publishes weights."""
