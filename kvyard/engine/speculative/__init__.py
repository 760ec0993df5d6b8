"""Speculative decoding: when and how much to propose (the policy), and the proposers: n-gram, a draft model, self-
drafts on the target's weights."""
