Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/fault_helpers.exs", __DIR__)
Code.require_file("support/telemetry.exs", __DIR__)
Code.require_file("support/doc_snippets.exs", __DIR__)

defmodule VllmBridge.GuideTest do
  # Runs every ```elixir snippet of README.md and docs/guide-elixir.md, as
  # written: a `# => value` line after an expression asserts that the expression
  # equals the value. The line before a snippet's fence may say what it needs:
  #
  #   <!-- run: start_children -->      start the `children` it binds, as a
  #                                     supervisor would (each must come up)
  #   <!-- run: pool=NAME:SIZE -->      a pool of that name and size runs
  #   <!-- run: torchless -->           `python_without_torch` is bound to a
  #                                     Python that cannot import torch
  #
  # Ports 29_500..29_599 become free ports. Some sections also get a test of
  # their own below, with checks beyond the snippet. Not async: the snippets
  # use fixed pool names and attach a global telemetry handler.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog
  import VllmBridge.PoolHelpers
  import VllmBridge.FaultHelpers

  alias VllmBridge.{Pool, Runtime, Worker}

  @moduletag timeout: 120_000
  @moduletag :tmp_dir

  @guide Path.join(VllmBridge.TestPython.root(), "docs/guide-elixir.md")

  # The ```elixir blocks of the section under `heading`, up to the next heading.
  defp snippets(heading) do
    @guide |> VllmBridge.DocSnippets.in_section(heading) |> Enum.map(&with_assertions/1)
  end

  @docs Enum.map(
          ["README.md", "docs/guide-elixir.md"],
          &Path.join(VllmBridge.TestPython.root(), &1)
        )
  for doc <- @docs, do: @external_resource(doc)

  for doc <- @docs, {file, line, options, code} <- VllmBridge.DocSnippets.blocks(doc) do
    @tag :capture_log
    test "#{file}:#{line} runs", %{tmp_dir: dir} do
      run_block!(unquote(Macro.escape(options)), unquote(code), dir)
    end
  end

  defp run_block!(options, code, dir) do
    for {:pool, name, size} <- options do
      start_supervised!(
        Supervisor.child_spec({Pool, name: name, size: size, timeout: 60_000}, id: name)
      )
    end

    binding =
      if :torchless in options, do: [python_without_torch: torchless_python!(dir)], else: []

    # Handlers a snippet attaches are detached after it, as a user's would be at exit.
    attached = Enum.map(:telemetry.list_handlers([]), & &1.id)

    on_exit(fn ->
      for %{id: id} <- :telemetry.list_handlers([]), id not in attached, do: :telemetry.detach(id)
    end)

    code = Regex.replace(~r/\b29_5\d\d\b/, code, fn _ -> to_string(free_tcp_port()) end)
    binding = run!(with_assertions(code), binding)

    if :start_children in options do
      children = Keyword.fetch!(binding, :children)
      for child <- children, do: start_supervised!(child)

      for {Pool, opts} <- children, do: warm!(Keyword.fetch!(opts, :name))
    end
  end

  defp with_assertions(code) do
    code
    |> String.split("\n")
    |> Enum.reduce([], fn
      "# => " <> value, [expression | rest] ->
        [
          "#{inspect(__MODULE__)}.same!((#{expression}), (#{value}), #{inspect(expression)})"
          | rest
        ]

      line, acc ->
        [line | acc]
    end)
    |> Enum.reverse()
    |> Enum.join("\n")
  end

  @doc false
  def same!(got, expected, expression) do
    assert got == expected, "#{expression} in #{@guide}"
  end

  defp run!(code, binding \\ []) do
    {_value, binding} = Code.eval_string(code, binding, file: @guide)
    binding
  end

  @tag :capture_log
  test "Start-up and restarts: a Python without torch is an error at start", %{tmp_dir: dir} do
    assert [code] = snippets("### Start-up and restarts")
    run!(code, python_without_torch: torchless_python!(dir))
    assert Process.whereis(MyApp.NoTorch) == nil
  end

  test "Lifecycle limits: the pool options" do
    assert [code] = snippets("### Lifecycle limits")
    children = Keyword.fetch!(run!(code), :children)

    for child <- children, do: start_supervised!(child)
    warm!(MyApp.Ranks)

    assert {:ok, 2} = Pool.size(MyApp.Ranks)
    {:ok, worker} = Pool.worker(MyApp.Ranks, 1)
    assert {:ok, %{max_calls: 10_000, max_memory_mb: 8_000}} = Worker.info(worker)
  end

  test "Telemetry: logging slow calls" do
    assert [code] = snippets("## Telemetry")
    true = VllmBridge.Telemetry.refresh()
    on_exit(fn -> :telemetry.detach("log-slow-bridge-calls") end)
    run!(code)

    pool = start_pool!(:guide_telemetry, 1)

    log =
      capture_log(fn ->
        assert {:ok, 0.6} = Runtime.call_function("sleep", [0.6], __runtime__: [pool: pool])
        assert {:ok, 0.0} = Runtime.call_function("sleep", [0.0], __runtime__: [pool: pool])
      end)

    assert log =~ ~r/sleep on :guide_telemetry worker 0 took \d+ ms/
    assert length(Regex.scan(~r/took/, log)) == 1
  end
end
