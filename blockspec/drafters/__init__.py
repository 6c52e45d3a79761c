"""Drafters that need no trained drafter checkpoint: prompt lookup and a small draft LM."""

from blockspec.drafters.draft_model import DraftModelDrafter, check_compatible, load_draft_model_drafter
from blockspec.drafters.ngram import PromptLookupDrafter

__all__ = ["DraftModelDrafter", "PromptLookupDrafter", "check_compatible", "load_draft_model_drafter"]
