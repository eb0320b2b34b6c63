"""How a replica runs its ranks: in-process (`local`, tp=1) or as Ray actors (`ray_tp`)."""
