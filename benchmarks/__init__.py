"""moeflow's benchmarks, by what they measure (README.md): ``python -m benchmarks`` lists them and runs one."""
