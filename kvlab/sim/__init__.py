"""The simulator's machinery: preparing a replay (prepare), the plain-Python reference replay
driving kvlab.policies (reference), the compiled kernels (kernels_*) and their dispatch
(dispatch), the miss-reason pass (kernels_reasons). ``kvlab.sim.simulator`` is the public face."""
