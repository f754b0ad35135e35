defmodule Mix.Tasks.VllmBridge.Setup do
  @shortdoc "Makes the Python environment the workers use (a venv with bridge_py and torch)"
  @moduledoc """
  Makes the Python environment that `VllmBridge.Pool` workers run in, for a
  project that depends on `:vllm_bridge`:

      mix vllm_bridge.setup                       # _build/vllm_bridge_venv, CPU torch
      mix vllm_bridge.setup --torch cuda          # torch as PyPI has it (with CUDA)
      mix vllm_bridge.setup --venv /opt/bridge    # somewhere else
      mix vllm_bridge.setup --dry-run             # print the commands only

  It runs `PYTHON -m venv VENV` (`--python`, default `python3`;
  `--system-site-packages` is passed on), then installs torch with
  `VENV/bin/python -m pip install`, then the dependency's `bridge_py`
  package and the rest of its requirements. Arguments after `--` go to the
  last `pip install` (`--quiet`, `--no-deps`, a mirror's `--index-url`).

  `--torch` says which torch:

    * `cpu` (default) - the CPU build, from PyTorch's CPU index
      (`https://download.pytorch.org/whl/cpu`): about 200 MB, what the
      guides use
    * `cuda` - the build PyPI has (on Linux, with the CUDA libraries: several
      GB), for pools on GPU machines
    * `none` - no torch step: for an environment that has torch already
      (`--system-site-packages`), or pip arguments that choose it

  The default `VENV` is `_build/vllm_bridge_venv` of the project the task
  runs in, where workers look for Python when neither the pool's `:python`
  option nor `VLLM_BRIDGE_PYTHON` names one
  (`VllmBridge.Worker.find_python/1`); for another `--venv`, point one of
  those at `VENV/bin/python`. A pool whose Python cannot import torch or
  `bridge_py` fails at start with an error that names the Python and the
  missing module, and says to run this task.
  """

  use Mix.Task

  @switches [
    python: :string,
    venv: :string,
    system_site_packages: :boolean,
    torch: :string,
    dry_run: :boolean
  ]
  @cpu_index "https://download.pytorch.org/whl/cpu"

  @impl Mix.Task
  def run(argv) do
    {opts, pip_args} = split(argv)
    root = VllmBridge.Worker.project_root()
    venv = Path.expand(opts[:venv] || VllmBridge.Worker.Command.setup_venv())
    python = Path.join(venv, "bin/python")
    site = if opts[:system_site_packages], do: ["--system-site-packages"], else: []

    steps =
      [{opts[:python] || "python3", ["-m", "venv" | site] ++ [venv]}] ++
        torch_step(opts[:torch] || "cpu", python) ++
        [{python, ["-m", "pip", "install"] ++ pip_args ++ [root]}]

    if opts[:dry_run] do
      Enum.each(steps, fn {executable, args} -> show(executable, args) end)
    else
      Enum.each(steps, fn {executable, args} -> run!(executable, args) end)

      Mix.shell().info("""
      Python for vllm_bridge workers: #{python}
      #{if opts[:venv], do: "Start pools with python: #{inspect(python)} or set VLLM_BRIDGE_PYTHON.", else: "Pools find it without any option."}
      """)
    end
  end

  defp torch_step("cpu", python),
    do: [{python, ["-m", "pip", "install", "torch", "--index-url", @cpu_index]}]

  defp torch_step("cuda", python), do: [{python, ["-m", "pip", "install", "torch"]}]
  defp torch_step("none", _python), do: []

  defp torch_step(other, _python),
    do: Mix.raise("--torch must be cpu, cuda or none, got #{inspect(other)}")

  defp split(argv) do
    {ours, pip_args} =
      case Enum.split_while(argv, &(&1 != "--")) do
        {ours, ["--" | rest]} -> {ours, rest}
        {ours, []} -> {ours, []}
      end

    case OptionParser.parse(ours, strict: @switches) do
      {opts, [], []} -> {opts, pip_args}
      {_, rest, invalid} -> Mix.raise("unexpected arguments: #{inspect(rest ++ invalid)}")
    end
  end

  defp show(executable, args) do
    path = System.find_executable(executable) || executable
    Mix.shell().info("$ #{Enum.join([path | args], " ")}")
    path
  end

  defp run!(executable, args) do
    path = show(executable, args)

    {_, status} =
      try do
        System.cmd(path, args, into: IO.stream(:stdio, :line), stderr_to_stdout: true)
      rescue
        error in ErlangError -> Mix.raise("cannot run #{path}: #{Exception.message(error)}")
      end

    if status != 0, do: Mix.raise("#{path} exited with status #{status}")
  end
end
