ExUnit.start(timeout: 120_000)
