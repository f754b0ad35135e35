# The long soak: 1,000,000 calls from 8 concurrent callers over 2 workers, with
# the checks of elixir/test/vllm_bridge/soak_test.exs (its 50,000-call version):
# every answer is the caller's own (pings of {caller, i}, increments of the
# caller's own Counter), Python RSS grows less than 10% after a warm-up, and
# no handle is left once everything is released.
#
#   mix run bench/elixir/soak.exs [--calls N] [--callers N] [--workers N]
#
# Prints calls/s and RSS after each tenth of the run; raises (non-zero exit) on
# a lost or crossed reply, a dead worker, RSS growth of 10% or more, or a
# handle left behind. Not part of `make test`.

Code.require_file("../../elixir/test/vllm_bridge/support/fault_helpers.exs", __DIR__)

alias VllmBridge.{Pool, Runtime, Soak, Worker}

{opts, _, _} =
  OptionParser.parse(System.argv(),
    strict: [calls: :integer, callers: :integer, workers: :integer]
  )

calls = Keyword.get(opts, :calls, 1_000_000)
callers = Keyword.get(opts, :callers, 8)
workers = Keyword.get(opts, :workers, 2)
pool = :soak_bench
session = "soak"
warm_up = min(10_000, max(div(calls, 10), 1_000))

{:ok, _} =
  Pool.start_link(
    name: pool,
    size: workers,
    cd: Worker.project_root(),
    args: ["--exports", "tests.worker.sample_exports:table"]
  )

for index <- 0..(workers - 1) do
  {:ok, :up} = Runtime.ping(:up, __runtime__: [pool: pool, worker: index, timeout: 120_000])
end

os_pids = Soak.os_pids(pool)

IO.puts(
  "soak: #{calls} calls, #{callers} callers, #{workers} workers (Python #{inspect(os_pids)})"
)

Soak.run(pool, warm_up, callers, session)
rss_before = Soak.rss_kib(pool)
IO.puts("after a warm-up of #{warm_up} calls: Python RSS #{rss_before} KiB")

chunks = 10
started = System.monotonic_time(:millisecond)

total =
  Enum.reduce(1..chunks, 0, fn chunk, done ->
    t0 = System.monotonic_time(:millisecond)
    n = Soak.run(pool, div(calls, chunks), callers, session)
    ms = max(System.monotonic_time(:millisecond) - t0, 1)
    rss = Soak.rss_kib(pool)

    IO.puts(
      "  #{chunk}/#{chunks}: #{done + n} calls, #{div(n * 1000, ms)} calls/s, " <>
        "Python RSS #{rss} KiB (#{Float.round((rss - rss_before) * 100 / rss_before, 2)}%)"
    )

    done + n
  end)

ms = max(System.monotonic_time(:millisecond) - started, 1)
rss_after = Soak.rss_kib(pool)
growth = (rss_after - rss_before) * 100 / rss_before
{:ok, left} = Runtime.release_session(session, __runtime__: [pool: pool])

IO.puts("""

| calls | callers | workers | calls/s | Python RSS before | after | growth | handles left |
|---|---|---|---|---|---|---|---|
| #{total} | #{callers} | #{workers} | #{div(total * 1000, ms)} | #{rss_before} KiB | #{rss_after} KiB | #{Float.round(growth, 2)}% | #{left} |
""")

cond do
  Soak.os_pids(pool) != os_pids -> raise "a Python worker was replaced during the soak"
  growth >= 10 -> raise "Python RSS grew #{Float.round(growth, 2)}% (limit 10%)"
  left != 0 -> raise "#{left} handles were left in session #{inspect(session)}"
  true -> IO.puts("soak: OK")
end
