"""What a request asks for and how its tokens are chosen and become text: sampling parameters, the sampler,
penalties, bad words, grammars, detokenizing."""
