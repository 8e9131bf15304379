pytest_plugins = ["hybridrl.testing"]
