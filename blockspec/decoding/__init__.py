"""Decoding: sampling, the one verifier, the drafter protocol and the speculative loop."""

from blockspec.decoding.drafter import Drafter, Proposal
from blockspec.decoding.generate import GenerationConfig, GenerationStats, Step, TokenStream, speculative_generate
from blockspec.sampling import SamplingConfig
from blockspec.decoding.verifier import Verdict, verify

__all__ = ["Drafter", "GenerationConfig", "GenerationStats", "Proposal", "SamplingConfig", "Step",
           "TokenStream", "Verdict", "speculative_generate", "verify"]
