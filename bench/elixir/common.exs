defmodule Bench do
  @moduledoc """
  Shared pieces of the Elixir benchmarks: options, statistics, rows, the printed
  table, and JSON lines appended to `$BENCH_OUT` for `bench/run`.

  Benchmarks print; they never fail on speed. They fail (raise) on wrong results.
  """

  def quick?, do: "--quick" in System.argv()

  def median(values), do: percentile(values, 50)

  @doc "Nearest-rank percentile."
  def percentile(values, p) do
    sorted = Enum.sort(values)
    n = length(sorted)
    Enum.at(sorted, max(0, ceil(p / 100 * n) - 1))
  end

  @doc "Microseconds, formatted."
  def fmt_us(us) when us >= 1_000_000, do: "#{:erlang.float_to_binary(us / 1.0e6, decimals: 2)} s"
  def fmt_us(us) when us >= 1_000, do: "#{:erlang.float_to_binary(us / 1.0e3, decimals: 2)} ms"
  def fmt_us(us), do: "#{:erlang.float_to_binary(us / 1.0, decimals: 1)} us"

  defp fmt_ratio(r), do: "#{:erlang.float_to_binary(r / 1.0, decimals: 2)}x"

  defp fmt_rate(x) do
    x
    |> round()
    |> Integer.to_string()
    |> String.reverse()
    |> String.replace(~r/(\d{3})(?=\d)/, "\\1,")
    |> String.reverse()
  end

  @doc """
  A row comparing two times (microseconds); ratio is ours/peer.
  Options: `at_most: k` (ours <= k x peer), `faster_by: k` (ours <= peer / k),
  `ours_text:`, `peer_text:` to override the formatted values.
  """
  def time_row(bench, what, ours, peer, peer_name, opts \\ []) do
    ratio = ours / peer

    {target, met} =
      cond do
        k = opts[:at_most] -> {"<= #{k}x peer", ratio <= k}
        k = opts[:faster_by] -> {">= #{k}x faster (<= #{Float.round(1 / k, 3)}x)", ratio <= 1 / k}
        true -> {"(info)", nil}
      end

    %{
      bench: bench,
      what: what,
      ours: opts[:ours_text] || fmt_us(ours),
      peer: "#{peer_name}: " <> (opts[:peer_text] || fmt_us(peer)),
      ratio: fmt_ratio(ratio),
      target: target,
      met: met
    }
  end

  @doc "A row comparing two counts of work (lower is better; never a target); ratio is ours/peer."
  def count_row(bench, what, ours, peer, peer_name, unit) do
    fmt = fn x -> "#{:erlang.float_to_binary(x / 1.0, decimals: 1)} #{unit}" end

    %{
      bench: bench,
      what: what,
      ours: fmt.(ours),
      peer: "#{peer_name}: " <> fmt.(peer),
      ratio: fmt_ratio(ours / peer),
      target: "(info)",
      met: nil
    }
  end

  @doc "A row comparing two rates (higher is better); ratio is ours/peer."
  def speed_row(bench, what, ours, peer, peer_name, unit, opts \\ []) do
    ratio = ours / peer

    {target, met} =
      cond do
        k = opts[:ratio_at_least] -> {">= #{k}x peer", ratio >= k}
        k = opts[:at_least] -> {">= #{fmt_rate(k)} #{unit}", ours >= k}
        true -> {"(info)", nil}
      end

    %{
      bench: bench,
      what: what,
      ours: "#{fmt_rate(ours)} #{unit}",
      peer: "#{peer_name}: #{fmt_rate(peer)} #{unit}",
      ratio: fmt_ratio(ratio),
      target: target,
      met: met
    }
  end

  def emit(title, rows) do
    IO.puts("\n## #{title}\n")
    IO.puts(render(rows))

    case System.get_env("BENCH_OUT") do
      out when out in [nil, ""] ->
        :ok

      out ->
        File.write!(out, Enum.map(rows, &[json(&1), "\n"]), [:append])
    end
  end

  def render(rows) do
    head = ["what", "ours", "peer", "ratio", "target", "met?"]
    body = for r <- rows, do: [r.what, r.ours, r.peer, r.ratio, r.target, met(r.met)]

    widths =
      Enum.zip_with([head | body], fn col -> col |> Enum.map(&String.length/1) |> Enum.max() end)

    [head, Enum.map(widths, &String.duplicate("-", &1)) | body]
    |> Enum.map(fn line ->
      cells = Enum.zip_with(line, widths, fn c, w -> String.pad_trailing(c, w) end)
      "| " <> Enum.join(cells, " | ") <> " |"
    end)
    |> Enum.join("\n")
  end

  defp met(nil), do: "-"
  defp met(true), do: "yes"
  defp met(false), do: "NO"

  # Enough JSON for flat maps of strings, numbers, booleans and nil.
  defp json(map) do
    fields =
      for {k, v} <- map do
        [json_value(to_string(k)), ":", json_value(v)]
      end

    ["{", Enum.intersperse(fields, ","), "}"]
  end

  defp json_value(nil), do: "null"
  defp json_value(true), do: "true"
  defp json_value(false), do: "false"
  defp json_value(n) when is_number(n), do: to_string(n)

  defp json_value(s) when is_binary(s) do
    escaped =
      for <<c::utf8 <- s>>, into: "" do
        case c do
          ?" -> "\\\""
          ?\\ -> "\\\\"
          c when c < 0x20 -> "\\u" <> String.pad_leading(Integer.to_string(c, 16), 4, "0")
          c -> <<c::utf8>>
        end
      end

    ["\"", escaped, "\""]
  end

  @doc "Fails the benchmark (wrong results are errors, slowness is not)."
  def check!(true, _message), do: :ok
  def check!(_, message), do: raise("wrong result: " <> message)

  @doc "Microseconds that `fun` takes, and its result."
  def tc(fun) do
    t0 = System.monotonic_time(:nanosecond)
    result = fun.()
    {(System.monotonic_time(:nanosecond) - t0) / 1000, result}
  end

  @doc """
  A `{:packet, 4}` Port to `python ARGS` (the worker's Python), owned by the
  caller, run in the project root with the root on `PYTHONPATH`.
  """
  def open_python(args) do
    root = VllmBridge.Worker.project_root()

    Port.open({:spawn_executable, VllmBridge.Worker.find_python()}, [
      :binary,
      {:packet, 4},
      :exit_status,
      :use_stdio,
      cd: root,
      env: [{~c"PYTHONPATH", String.to_charlist(root)}],
      args: args
    ])
  end

  @doc "The raw peer: a Port to bench/python/echo_port.py, owned by the caller."
  def open_echo, do: open_python(["bench/python/echo_port.py"])

  @doc """
  Writes `frame` to `port` and waits for the frame it sends back. With `spin_us`,
  the caller first looks for it for that many microseconds, yielding a whole
  time slice in between, as a runtime caller does (`:reply_spin_us`, "Waiting
  for a reply" in `VllmBridge.Worker`).
  """
  def echo(port, frame, timeout \\ 60_000, spin_us \\ 0) do
    Port.command(port, frame)
    until = if spin_us > 0, do: :erlang.monotonic_time(:microsecond) + spin_us
    await_echo(port, timeout, until)
  end

  defp await_echo(port, timeout, until) do
    receive do
      {^port, {:data, data}} -> data
      {^port, {:exit_status, s}} -> raise "echo_port.py exited with status #{s}"
    after
      if(until, do: 0, else: timeout) ->
        cond do
          until == nil ->
            raise "no echo within #{timeout} ms"

          :erlang.monotonic_time(:microsecond) < until ->
            :erlang.bump_reductions(4000)
            :erlang.yield()
            await_echo(port, timeout, until)

          true ->
            await_echo(port, timeout, nil)
        end
    end
  end

  @doc """
  A StatelessProcessGroup of one rank on a worker of `pool` (one serving the shipped
  table), on a free port of 127.0.0.1: what the generated modules' rows call.
  """
  def one_rank_group(pool) do
    {:ok, socket} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
    {:ok, port} = :inet.port(socket)
    :ok = :gen_tcp.close(socket)

    {:ok, group} =
      Vllm.Distributed.StatelessProcessGroup.create(nil, "127.0.0.1", port, 0, 1, [],
        __runtime__: [pool: pool, timeout: 120_000]
      )

    group
  end
end
