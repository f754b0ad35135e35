defmodule VllmBridge.MixTasksTest do
  # A project that depends on :vllm_bridge (a path dependency on this checkout,
  # compiled in a scratch directory) must not be offered, nor be able to run,
  # the task that rewrites vllm_bridge's generated modules.
  use ExUnit.Case, async: true

  @moduletag :tmp_dir
  @moduletag timeout: 300_000

  @root Path.expand("../../..", __DIR__)

  test "a dependency's user neither sees nor runs mix vllm_bridge.gen", %{tmp_dir: dir} do
    app = user_app!(dir)
    generated = generated_files()
    mix = fn args -> System.cmd("mix", args, cd: app, stderr_to_stdout: true, env: env()) end

    assert {_, 0} = mix.(["compile"])
    {help, 0} = mix.(["help"])
    assert help =~ "mix compile"
    refute help =~ "vllm_bridge.gen"

    {out, status} = mix.(["vllm_bridge.gen"])
    assert status != 0
    assert out =~ "runs only in the vllm_bridge project"
    assert generated_files() == generated
  end

  # Needs the package index (as `make setup` does): pip builds bridge_py in isolation.
  test "mix vllm_bridge.setup makes a venv with the dependency's bridge_py", %{tmp_dir: dir} do
    app = user_app!(dir)
    venv = Path.join(dir, "venv")
    args = ["vllm_bridge.setup", "--venv", venv, "--torch", "none", "--", "--no-deps", "--quiet"]
    {out, status} = System.cmd("mix", args, cd: app, stderr_to_stdout: true, env: env())
    assert status == 0, out
    python = Path.join(venv, "bin/python")
    assert out =~ "Python for vllm_bridge workers: #{python}"

    # Installed into the venv (not imported from the checkout), with the wire schema.
    script = "import bridge_py, sys; print(bridge_py.__file__)"
    {file, 0} = System.cmd(python, ["-c", script], cd: dir)
    assert String.starts_with?(file, venv)

    {out, status} =
      System.cmd("mix", ["vllm_bridge.setup", "--bogus"],
        cd: app,
        stderr_to_stdout: true,
        env: env()
      )

    assert status != 0 and out =~ "unexpected arguments"
  end

  # Issue 37: with no options the task installed the newest torch with the whole
  # CUDA stack (5.5 GB), into the dependency's own folder (for a path dependency,
  # that checkout's development venv).
  test "mix vllm_bridge.setup: the CPU torch, into the app's _build, found by pools",
       %{tmp_dir: dir} do
    app = user_app!(dir)
    mix = fn args -> System.cmd("mix", args, cd: app, stderr_to_stdout: true, env: env()) end
    venv = Path.join(app, "_build/vllm_bridge_venv")

    {out, 0} = mix.(["vllm_bridge.setup", "--dry-run"])
    [make, torch, bridge] = out |> String.split("\n", trim: true) |> Enum.filter(&(&1 =~ "$ "))
    assert make =~ ~r{ -m venv #{venv}$}

    assert torch =~
             "#{venv}/bin/python -m pip install torch --index-url " <>
               "https://download.pytorch.org/whl/cpu"

    assert bridge =~ "#{venv}/bin/python -m pip install #{@root}"
    refute File.exists?(venv)

    {out, 0} = mix.(["vllm_bridge.setup", "--dry-run", "--torch", "cuda"])
    assert out =~ ~r{pip install torch$}m

    {out, 0} = mix.(["vllm_bridge.setup", "--dry-run", "--torch", "none"])
    refute out =~ "pip install torch"

    {out, status} = mix.(["vllm_bridge.setup", "--torch", "gpu"])
    assert status != 0 and out =~ "--torch must be cpu, cuda or none"

    # the workers of the app's pools find that environment without any option
    python = Path.join(venv, "bin/python")
    File.mkdir_p!(Path.dirname(python))
    File.write!(python, "")
    # (without VLLM_BRIDGE_PYTHON, which would come first)
    {out, 0} =
      System.cmd("mix", ["run", "--no-start", "-e", "IO.puts(VllmBridge.Worker.find_python([]))"],
        cd: app,
        stderr_to_stdout: true,
        env: [{"VLLM_BRIDGE_PYTHON", nil} | env()]
      )

    assert String.trim(out) |> String.split("\n") |> List.last() == python
  end

  defp user_app!(dir) do
    app = Path.join(dir, "user_app")
    File.mkdir_p!(Path.join(app, "lib"))

    File.write!(Path.join(app, "mix.exs"), """
    defmodule UserApp.MixProject do
      use Mix.Project

      def project do
        [app: :user_app, version: "0.1.0", deps: [{:vllm_bridge, path: #{inspect(@root)}}]]
      end
    end
    """)

    app
  end

  defp env, do: [{"MIX_ENV", "dev"}]

  defp generated_files do
    for path <- Path.wildcard(Path.join(@root, "elixir/lib/vllm/**/*.ex")),
        into: %{},
        do: {path, File.read!(path)}
  end
end
