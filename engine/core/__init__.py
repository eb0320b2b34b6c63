"""One replica's step loop: input processing, scheduler, batch, sampler, decoding strategies,
stop rule, output builder and `LLMEngine`, which runs them in that order."""
