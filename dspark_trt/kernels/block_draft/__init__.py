"""DSpark block drafting: the Markov step p_k = softmax((U_k + W1[x_{k-1}]·W2) / T) sampled left to right over γ
positions. reference.py (torch semantics), kernel.py (Triton), launch.py (torch launchers), trt.py (TensorRT QDP).
Importing this package imports neither triton nor tensorrt.
"""
