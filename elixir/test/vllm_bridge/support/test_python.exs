defmodule VllmBridge.TestPython do
  @moduledoc false
  # Finds the Python the runtime would use, for cross-checks against the
  # Python implementation. Tests that need it skip their Python part when
  # there is none.

  @root Path.expand("../../../..", __DIR__)

  def root, do: @root

  def python do
    python = VllmBridge.Worker.find_python([])

    cond do
      Path.type(python) == :absolute and File.exists?(python) -> python
      exe = System.find_executable(python) -> exe
      true -> nil
    end
  end

  def has_module?(python, module) do
    match?({_, 0}, System.cmd(python, ["-c", "import #{module}"], stderr_to_stdout: true))
  end

  # The Python worker package is present (the colleague's side has landed).
  def worker_available? do
    python = python()

    python != nil and File.exists?(Path.join(@root, "bridge_py/worker/__main__.py")) and
      match?(
        {_, 0},
        System.cmd(python, ["-c", "import bridge_py.worker"],
          cd: @root,
          stderr_to_stdout: true,
          env: [{"PYTHONPATH", @root}]
        )
      )
  end
end
