"""One router per resource: studies (and their trials), results (best, plan, export), service."""
