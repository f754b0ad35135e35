defmodule Mix.Tasks.VllmBridge.Gen do
  @shortdoc "Regenerates the Vllm.* modules from the Python export table"
  @moduledoc """
  Regenerates `elixir/lib/vllm/**` by running the Python code generator,
  `python -m bridge_py.codegen`, with the Python the runtime would use
  (see `VllmBridge.Worker.find_python/1`).

      mix vllm_bridge.gen           # write the files
      mix vllm_bridge.gen --check   # exit non-zero if they are out of date

  The generated files are checked in and never edited by hand: change the
  Python side (the export table, signatures, docstrings) and run this task.
  """

  use Mix.Task

  @root Path.expand("../../../..", __DIR__)

  @impl Mix.Task
  def run(argv) do
    python = VllmBridge.Worker.find_python([])

    {_, status} =
      System.cmd(python, ["-m", "bridge_py.codegen" | argv],
        cd: @root,
        env: [{"PYTHONPATH", @root}],
        into: IO.stream(:stdio, :line),
        stderr_to_stdout: true
      )

    if status != 0, do: Mix.raise("bridge_py.codegen exited with status #{status}")
  end
end
