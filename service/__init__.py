"""Detour: a shared broker fault table for RocketMQ-style producers."""
