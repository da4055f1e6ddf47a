"""Coordinator: prompts, rewards, admission and scheduling, the queue producer, the CLI and launcher."""
