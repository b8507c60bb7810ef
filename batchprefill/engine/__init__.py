"""The single-device engine: block pool and prefix cache, scheduler, model runner, sampler."""
