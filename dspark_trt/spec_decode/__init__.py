"""The DSpark algorithm, pure torch: protocols, acceptance (greedy / rejection sampling), confidence, K policies,
statistics and the speculative loop (one RoundScheduler, loop.py) with the reference runtime's round executor
(executor.py). Imports nothing from runtime/, serve/, builder/ or tritonclient; models are reached only through
spec_decode.protocols (Backend / Drafter, or a RoundExecutor such as serve.gpu_host.rounds.TrtllmExecutor).
"""
