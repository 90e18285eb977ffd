"""Flow matching: the path (`flow.path`: noising, target velocity, loss; t = 0 noise, t = 1 data) and the
ODE solvers that integrate it back (`flow.solver`: time grid, Euler, Heun), and classifier-free guidance
(`flow.guidance`: a row and its null-label twin in one forward, combined v_n + s (v_c - v_n)).

Below training (which fits the path's targets), the coordinator (which steps rows with the solver) and
evaluation / `ddm-fleet sample` (which run the solver in one process). Plain numpy at import; torch only
inside the torch helpers of `flow.path`.
"""
