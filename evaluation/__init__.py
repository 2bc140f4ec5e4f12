"""Evaluation of kvpress-critical with kvpress's own runner: sweep driver, aggregation, leaderboard packaging."""
