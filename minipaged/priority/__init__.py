"""Priority scheduling (lesson 13): `scheduling_policy="priority"` and a `priority` per request.

`scheduling.py` holds the policy, a mixin over the core `Scheduler` that engine/build.py
composes in when the config asks for it; with the default "fcfs" nothing of it is in the engine.
"""
from minipaged.priority.scheduling import PriorityScheduling, priority_key

__all__ = ["PriorityScheduling", "priority_key"]
