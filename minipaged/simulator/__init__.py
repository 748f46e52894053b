"""The engine on a virtual clock, for lesson 13: sweep request rates in seconds on a laptop.

    cost_model.py   a step's seconds from what it computes, fitted to a real engine's trace
    clock.py        `simulate`: the real Scheduler + BlockManager stepped by a discrete-event
                    loop over arrivals, timed by the cost model; per-request TTFT, latency
    replay.py       the same arrival trace through a real LLMEngine (by step, or wall clock)
    admission.py    reservation-based admission (Orca Max / Pow2 / Oracle) and static batching,
                    as scheduler mixins: the systems the vLLM paper compares against
    sweep.py        normalized latency against request rate, the knee, capacity ratios
"""
from minipaged.simulator.clock import (RequestTimes, SimRequest, SimResult, requests_from_workload,
                                       simulate)
from minipaged.simulator.cost_model import StepCostModel

__all__ = ["RequestTimes", "SimRequest", "SimResult", "StepCostModel", "requests_from_workload",
           "simulate"]
