"""dspark_trt."""
