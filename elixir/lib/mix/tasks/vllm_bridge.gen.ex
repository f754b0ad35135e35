defmodule Mix.Tasks.VllmBridge.Gen do
  # No @shortdoc: `mix help` in a project that depends on :vllm_bridge does not
  # offer to rewrite the dependency's files.
  @moduledoc """
  Regenerates `elixir/lib/vllm/**`, and the wire schema's tables
  (`VllmBridge.Proto.Schema`, `bridge_py/worker/schema.py`) from `proto/`, by
  running the Python code generator, `python -m bridge_py.codegen`, with the
  Python the runtime would use (see `VllmBridge.Worker.find_python/1`).

      mix vllm_bridge.gen           # write the files
      mix vllm_bridge.gen --check   # exit non-zero if they are out of date

  The generated files are checked in and never edited by hand: change the
  Python side (the export table, signatures, docstrings) or the schema in
  `proto/` and run this task.
  It is a tool for developing vllm_bridge itself: run from a project that
  merely depends on it, it refuses and changes nothing.
  """

  use Mix.Task

  @root Path.expand("../../../..", __DIR__)

  @impl Mix.Task
  def run(argv) do
    if Mix.Project.config()[:app] != :vllm_bridge do
      Mix.raise(
        "mix vllm_bridge.gen regenerates vllm_bridge's own modules and runs only in the " <>
          "vllm_bridge project, not in a project that depends on it"
      )
    end

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
