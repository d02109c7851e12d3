"""The DSpark algorithm, pure torch: protocols, acceptance (greedy / rejection sampling), confidence, K policies,
statistics and the speculative loop. Imports nothing from runtime/, serve/, builder/ or tritonclient; models are
reached only through spec_decode.protocols.Backend / Drafter.
"""
