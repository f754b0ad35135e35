defmodule VllmBridge.WorkerPartsTest do
  # The examples in the docs of the modules VllmBridge.Worker is built from.
  use ExUnit.Case, async: true

  doctest VllmBridge.Worker.Command
  doctest VllmBridge.Worker.Limits
  doctest VllmBridge.Worker.Options
  doctest VllmBridge.Worker.Output
  doctest VllmBridge.Worker.Startup
end
