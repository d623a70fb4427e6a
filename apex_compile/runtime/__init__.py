"""Runtime: paged KV memory across device and host, scheduler, engine, sampler."""
