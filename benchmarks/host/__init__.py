"""Host cost of the scheduler and engine on the CPU: microseconds per layer and step, counted launches."""
