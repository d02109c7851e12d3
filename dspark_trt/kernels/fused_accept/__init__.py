"""Fused acceptance (verify one speculative round in one read of the logits): kernel.py (Triton), launch.py
(torch launchers), trt.py (TensorRT QDP registration). Importing this package imports neither triton nor tensorrt.
"""
