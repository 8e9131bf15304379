pytest_plugins = ["hybridrl_testing"]
