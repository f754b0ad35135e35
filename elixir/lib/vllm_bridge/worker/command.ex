defmodule VllmBridge.Worker.Command do
  @moduledoc """
  The command line that runs a worker's Python process, as plain data.

  A `VllmBridge.Worker` runs `python -m bridge_py.worker --output frames`
  behind an Erlang port. This module decides which Python that is
  (`find_python/1`), and builds the options for `Port.open/2`: the
  arguments, the working directory and the environment, where the project
  root is prepended to `PYTHONPATH` so `bridge_py` imports without being
  installed. It also builds the command that runs a failed Python once more
  through `sh`, with stdin at end-of-file and stderr captured, to read why
  it failed (see "Start-up" in `VllmBridge.Worker`).

  Nothing here opens a port: `VllmBridge.Worker.OSProcess` does.

  `spawn` below is the keyword list of the worker's `:args`, `:env` and
  `:cd` options.
  """

  @project_root Path.expand("../../../..", __DIR__)

  # Where `mix vllm_bridge.setup` puts the environment by default: beside the
  # build of the project being compiled (for a dependency: the app's
  # `_build`), whichever Mix environment builds it.
  @setup_venv Path.join(Path.dirname(Mix.Project.build_path()), "vllm_bridge_venv")

  @doc """
  Where `mix vllm_bridge.setup` makes the Python environment unless told
  otherwise: `_build/vllm_bridge_venv` of the project that depends on
  `:vllm_bridge` (fixed at compile time).
  """
  @spec setup_venv() :: Path.t()
  def setup_venv, do: @setup_venv

  @doc "The project root, where `bridge_py` lives (fixed at compile time)."
  @spec project_root() :: Path.t()
  def project_root, do: @project_root

  @doc """
  The Python executable for a worker's `opts`: the `:python` option, else
  the `VLLM_BRIDGE_PYTHON` environment variable, else the environment that
  `mix vllm_bridge.setup` made (`setup_venv/0`) when it exists, else
  `.venv/bin/python` of the `:vllm_bridge` checkout when it exists (its
  development environment), else `python3`.
  """
  @spec find_python(keyword()) :: Path.t()
  def find_python(opts) do
    setup = Path.join(@setup_venv, "bin/python")
    venv = Path.join(@project_root, ".venv/bin/python")

    cond do
      python = opts[:python] -> python
      (python = System.get_env("VLLM_BRIDGE_PYTHON")) not in [nil, ""] -> python
      File.exists?(setup) -> setup
      File.exists?(venv) -> venv
      true -> "python3"
    end
  end

  @doc """
  The path of `python` to spawn: itself when absolute, else looked up in
  `PATH` (`nil` when not found).
  """
  @spec executable(Path.t()) :: Path.t() | nil
  def executable(python) do
    if Path.type(python) == :absolute, do: python, else: System.find_executable(python)
  end

  @doc """
  The `Port.open/2` options that run `bridge_py.worker` with its output sent
  as frames: 4-byte length-prefixed binary packets over stdin and stdout.
  """
  @spec port_options(keyword()) :: list()
  def port_options(spawn) do
    [
      :binary,
      {:packet, 4},
      :exit_status,
      :use_stdio,
      :hide,
      args: ["-m", "bridge_py.worker", "--output", "frames" | Keyword.get(spawn, :args, [])],
      env: env(Keyword.get(spawn, :env, []))
    ] ++ cd(spawn)
  end

  @doc """
  The executable and `Port.open/2` options that run `python -m
  bridge_py.worker` again through `sh`, with stdin at end-of-file and stderr
  sent to stdout, to read what a Python that failed to start prints.
  """
  @spec diagnosis_command(Path.t(), keyword()) :: {Path.t(), list()}
  def diagnosis_command(python, spawn) do
    args = ["-c", "exec \"$0\" \"$@\" </dev/null 2>&1", python, "-m", "bridge_py.worker"]

    port_options =
      [
        :binary,
        :exit_status,
        :hide,
        args: args ++ Keyword.get(spawn, :args, []),
        env: env(Keyword.get(spawn, :env, []))
      ] ++ cd(spawn)

    {System.find_executable("sh") || "/bin/sh", port_options}
  end

  defp cd(spawn), do: if(cd = spawn[:cd], do: [cd: cd], else: [])

  @doc """
  The port's environment for the worker's `:env` option: `{name, value}`
  pairs as charlists (a `nil` value unsets the variable), with the project
  root prepended to `PYTHONPATH` (the one in `env`, else the inherited one).

  ## Examples

      iex> [{~c"PYTHONPATH", path}] = VllmBridge.Worker.Command.env(%{"PYTHONPATH" => "/x"})
      iex> List.to_string(path) == VllmBridge.Worker.Command.project_root() <> ":/x"
      true
  """
  @spec env([{String.t(), String.t() | nil}] | %{String.t() => String.t() | nil}) ::
          [{charlist(), charlist() | false}]
  def env(env) do
    env = Enum.map(env, fn {k, v} -> {to_string(k), v && to_string(v)} end)

    pythonpath =
      case List.keyfind(env, "PYTHONPATH", 0) do
        {_, value} when value not in [nil, ""] -> value
        _ -> System.get_env("PYTHONPATH")
      end

    pythonpath =
      if pythonpath in [nil, ""],
        do: @project_root,
        else: @project_root <> ":" <> pythonpath

    env
    |> List.keystore("PYTHONPATH", 0, {"PYTHONPATH", pythonpath})
    |> Enum.map(fn
      {k, nil} -> {String.to_charlist(k), false}
      {k, v} -> {String.to_charlist(k), String.to_charlist(v)}
    end)
  end
end
