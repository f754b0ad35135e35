defmodule Mix.Tasks.VllmBridge.Setup do
  @shortdoc "Makes the Python environment the workers use (a venv with bridge_py and torch)"
  @moduledoc """
  Makes the Python environment that `VllmBridge.Pool` workers run in, for a
  project that depends on `:vllm_bridge` (a git or path dependency has no
  `.venv` of its own):

      mix vllm_bridge.setup                       # deps/vllm_bridge/.venv
      mix vllm_bridge.setup --venv /opt/bridge    # somewhere else
      mix vllm_bridge.setup -- --index-url https://download.pytorch.org/whl/cpu

  It runs `PYTHON -m venv VENV` (`--python`, default `python3`;
  `--system-site-packages` is passed on), then `VENV/bin/python -m pip install`
  the dependency's `bridge_py` package, which brings torch and the rest of its
  requirements; arguments after `--` go to `pip install` (an index URL for a
  CPU-only or a CUDA torch, `--no-deps`, ...).

  The default `VENV`, the `.venv` directory of the `:vllm_bridge` dependency,
  is where workers look for Python when neither the pool's `:python` option nor
  `VLLM_BRIDGE_PYTHON` names one (`VllmBridge.Worker.find_python/1`); for
  another `--venv`, point one of those at `VENV/bin/python`. Without any of
  them the workers try `python3`, and a pool whose Python cannot import torch
  or `bridge_py` fails at start with an error naming the Python and the
  missing module.
  """

  use Mix.Task

  @switches [python: :string, venv: :string, system_site_packages: :boolean]

  @impl Mix.Task
  def run(argv) do
    {opts, pip_args} = split(argv)
    root = VllmBridge.Worker.project_root()
    venv = Path.expand(opts[:venv] || Path.join(root, ".venv"))
    base = opts[:python] || "python3"
    site = if opts[:system_site_packages], do: ["--system-site-packages"], else: []

    run!(base, ["-m", "venv" | site] ++ [venv])
    python = Path.join(venv, "bin/python")
    run!(python, ["-m", "pip", "install"] ++ pip_args ++ [root])

    Mix.shell().info("""
    Python for vllm_bridge workers: #{python}
    #{if opts[:venv], do: "Start pools with python: #{inspect(python)} or set VLLM_BRIDGE_PYTHON.", else: "Pools find it without any option."}
    """)
  end

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

  defp run!(executable, args) do
    path = System.find_executable(executable) || executable
    Mix.shell().info("$ #{Enum.join([path | args], " ")}")

    {_, status} =
      try do
        System.cmd(path, args, into: IO.stream(:stdio, :line), stderr_to_stdout: true)
      rescue
        error in ErlangError -> Mix.raise("cannot run #{path}: #{Exception.message(error)}")
      end

    if status != 0, do: Mix.raise("#{path} exited with status #{status}")
  end
end
