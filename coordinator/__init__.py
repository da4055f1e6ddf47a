"""Coordinator: prompts, rewards, admission and scheduling, the queue producer, the admin API and dashboard, the agent API."""
