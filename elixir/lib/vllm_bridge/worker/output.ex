defmodule VllmBridge.Worker.Output do
  @moduledoc """
  What a worker logs about its Python process: the lines Python printed, and
  the replies with id 0 that carry them (see "Output" in
  `VllmBridge.Worker`).

  Python sends what it writes on stdout and stderr as output frames, already
  bounded on its side (a line keeps its first 4096 bytes; lines over its
  rate limit are dropped and counted). Each line is logged at the
  `:warning` level as `"<pool> worker <index> (os pid <pid>): <line>"` with
  Logger metadata `:pool`, `:index` and `:os_pid`; bytes that are not UTF-8
  become U+FFFD.

  The functions take the worker's state for its `:pool`, `:index` and
  `:os_pid`, and run in the worker process (a worker outside a pool is named
  by its pid).
  """

  require Logger

  alias VllmBridge.Proto

  @doc """
  Handles a reply with id 0 from Python: an output frame's lines are
  returned, and logged line by line unless Python is still starting (the
  worker holds those: it logs them once Python has started, and a failed
  start reports them in its error instead); a request Python could not
  read, or a reply that cannot be decoded, is logged, and `[]` is returned.
  """
  @spec unsolicited(map(), binary()) :: [String.t()]
  def unsolicited(state, reply) do
    case Proto.decode_reply(reply) do
      {:ok, %{result: {:output, output}}} ->
        log(state, output, state.phase != :starting)

      {:ok, %{result: {:error, %{message: message}}}} ->
        Logger.warning(
          "#{describe(state)}: the Python worker could not read a request: #{message}",
          metadata(state)
        )

        []

      _ ->
        Logger.warning("#{describe(state)}: unreadable reply with id 0", metadata(state))
        []
    end
  end

  @doc """
  Logs an output frame's `text`, line by line (when `lines?`), and the count
  of lines Python `dropped` before it, if any; returns the lines.
  """
  @spec log(map(), %{text: iodata(), dropped: non_neg_integer()}, boolean()) :: [String.t()]
  def log(state, %{text: text, dropped: dropped}, lines? \\ true) do
    metadata = metadata(state)

    if dropped > 0 do
      Logger.warning(
        "#{describe(state)} (os pid #{state.os_pid}): #{dropped} more lines printed by " <>
          "the Python worker were dropped (over its output rate limit)",
        metadata
      )
    end

    lines = text |> IO.iodata_to_binary() |> String.split("\n", trim: true)
    if lines?, do: log_lines(state, lines)
    lines
  end

  @doc "Logs `lines` Python printed, one message each."
  @spec log_lines(map(), [String.t()]) :: :ok
  def log_lines(state, lines) do
    metadata = metadata(state)

    for line <- lines do
      Logger.warning("#{describe(state)} (os pid #{state.os_pid}): #{printable(line)}", metadata)
    end

    :ok
  end

  @doc """
  How log messages name the worker: `"<pool> worker <index>"`, or
  `"VllmBridge.Worker <pid>"` outside a pool (the pid of the calling
  process, the worker).
  """
  @spec describe(map()) :: String.t()
  def describe(%{pool: nil}), do: "VllmBridge.Worker #{inspect(self())}"
  def describe(%{pool: pool, index: index}), do: "#{inspect(pool)} worker #{index}"

  @doc "The Logger metadata of the worker's messages about its Python process."
  @spec metadata(map()) :: keyword()
  def metadata(state), do: [pool: state.pool, index: state.index, os_pid: state.os_pid]

  @doc """
  `line` as text for Logger: bytes that are not UTF-8 become U+FFFD.

  ## Examples

      iex> VllmBridge.Worker.Output.printable(<<"ok ", 0xFF, "!">>)
      "ok \\uFFFD!"
  """
  @spec printable(binary()) :: String.t()
  def printable(line) do
    if String.valid?(line) do
      line
    else
      for char <- String.codepoints(line),
          into: "",
          do: if(String.valid?(char), do: char, else: "\uFFFD")
    end
  end
end
