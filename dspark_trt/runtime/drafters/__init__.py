"""Drafters behind spec_decode.protocols.Drafter: the DSpark block drafter and plain/PARD LM drafters.

Public API: load_drafter, default_drafter_dir, check_same_vocabulary, DSparkDrafter, DSparkModel,
DSparkConfig, LMDrafter, save_dspark, load_dspark_model.
"""
from dspark_trt.runtime.drafters.config import DSparkConfig
from dspark_trt.runtime.drafters.dspark import DSparkDrafter, DSparkModel
from dspark_trt.runtime.drafters.lm import LMDrafter
from dspark_trt.runtime.drafters.loader import (default_drafter_dir, load_drafter, load_dspark_model, save_dspark,
                                                target_weights)
from dspark_trt.runtime.drafters.vocab import (VOCAB_MSG, VocabInfo, check_same_vocabulary, target_fingerprint,
                                               vocab_info)

__all__ = ["VOCAB_MSG", "DSparkConfig", "DSparkDrafter", "DSparkModel", "LMDrafter", "VocabInfo",
           "check_same_vocabulary", "default_drafter_dir", "load_drafter", "load_dspark_model", "save_dspark",
           "target_fingerprint", "target_weights", "vocab_info"]
