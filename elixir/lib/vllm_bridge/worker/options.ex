defmodule VllmBridge.Worker.Options do
  @moduledoc """
  Checks of the options of `VllmBridge.Worker.start_link/1` that must be
  valid before a worker starts: the health-check timings, the lifecycle
  limits, how callers wait for replies and what the Python process is
  started with, and the defaults of those that have one; and of the options
  `VllmBridge.Pool.start_link/1` adds (`check_pool/1`). Each check looks
  only at the options it names, and only when they are given (a missing one
  takes its valid default, `defaults/0`).

  The results are `:ok` or `{:error, %VllmBridge.Error{category: :bad_args}}`
  whose message names the option, the kind of value it takes and the value
  it got, e.g. `":max_calls must be a positive integer or nil, got 0"`.
  """

  alias VllmBridge.Error

  @defaults [
    health_interval: 5_000,
    health_timeout: 5_000,
    # the back-off between failed starts of a Python process (ms)
    backoff_min: 500,
    backoff_max: 30_000,
    # how long a caller looks for its reply before it sleeps in `receive` (us)
    reply_spin_us: 50
  ]

  # The longest a `receive ... after` or a timer may wait: about 49.7 days.
  @longest_ms 4_294_967_295

  @doc """
  Whether `value` is a wait the BEAM can time, in milliseconds: an integer
  from `least` to #{@longest_ms} (about 49.7 days, the longest `receive ...
  after`). Every option of this library that is a time in milliseconds is
  checked with it (`:infinity` is allowed besides where an option says so).

  ## Examples

      iex> VllmBridge.Worker.Options.ms?(120_000, 0)
      true

      iex> VllmBridge.Worker.Options.ms?(4_294_967_296, 0)
      false
  """
  @spec ms?(term(), non_neg_integer()) :: boolean()
  def ms?(value, least), do: is_integer(value) and value >= least and value <= @longest_ms

  @doc """
  Whether `value` is a timeout: `:infinity`, or `ms?(value, least)`.

  ## Examples

      iex> VllmBridge.Worker.Options.timeout?(:infinity, 1)
      true
  """
  @spec timeout?(term(), non_neg_integer()) :: boolean()
  def timeout?(value, least), do: value == :infinity or ms?(value, least)

  @doc """
  Runs every check of this module on `opts`, which must be a keyword list:
  `:ok`, or the `:bad_args` error of the first option that fails.
  `VllmBridge.Worker.start_link/1` and `VllmBridge.Pool.start_link/1` (whose
  options reach its workers) both check with it.

  ## Examples

      iex> VllmBridge.Worker.Options.check_all(health_interval: false, args: ["-v"])
      :ok

      iex> {:error, error} = VllmBridge.Worker.Options.check_all(:verbose)
      iex> error.message
      "options must be a keyword list, got :verbose"
  """
  @spec check_all(term()) :: :ok | {:error, Error.t()}
  def check_all(opts) do
    if Keyword.keyword?(opts) do
      Enum.find_value(
        [&check_health/1, &check_lifecycle/1, &check_calls/1, &check_spawn/1],
        :ok,
        fn check -> with :ok <- check.(opts), do: nil end
      )
    else
      {:error, Error.new(:bad_args, "options must be a keyword list, got #{inspect(opts)}")}
    end
  end

  @doc """
  The defaults of the options checked here that have one (`:max_calls` and
  `:max_memory_mb` default to `nil`, no limit).

  ## Examples

      iex> VllmBridge.Worker.Options.defaults()
      [health_interval: 5000, health_timeout: 5000, backoff_min: 500, backoff_max: 30000, reply_spin_us: 50]
  """
  @spec defaults() :: keyword(pos_integer())
  def defaults, do: @defaults

  @doc """
  Checks `:health_interval` and `:health_timeout`.

  ## Examples

      iex> VllmBridge.Worker.Options.check_health(health_interval: 1_000, other: :ignored)
      :ok
  """
  @spec check_health(keyword()) :: :ok | {:error, Error.t()}
  def check_health(opts) do
    check(opts,
      health_interval:
        {"a positive integer (ms, at most #{@longest_ms}) or false", &(ms?(&1, 1) or &1 == false)},
      health_timeout: {"a positive integer (ms, at most #{@longest_ms})", &ms?(&1, 1)}
    )
  end

  @doc """
  Checks `:max_calls`, `:max_memory_mb`, `:backoff_min` and `:backoff_max`.

  ## Examples

      iex> {:error, error} = VllmBridge.Worker.Options.check_lifecycle(backoff_min: -1)
      iex> {error.category, error.details}
      {:bad_args, %{backoff_min: -1}}
  """
  @spec check_lifecycle(keyword()) :: :ok | {:error, Error.t()}
  def check_lifecycle(opts) do
    check(opts,
      max_calls: {"a positive integer or nil", &(&1 == nil or positive?(&1))},
      max_memory_mb: {"a positive integer (MB) or nil", &(&1 == nil or positive?(&1))},
      backoff_min: {"a positive integer (ms, at most #{@longest_ms})", &ms?(&1, 1)},
      backoff_max: {"a positive integer (ms, at most #{@longest_ms})", &ms?(&1, 1)}
    )
  end

  @doc """
  Checks `:reply_spin_us`.

  ## Examples

      iex> {:error, error} = VllmBridge.Worker.Options.check_calls(reply_spin_us: -1)
      iex> error.message
      ":reply_spin_us must be a non-negative integer (us), at most 1000, got -1"
  """
  @spec check_calls(keyword()) :: :ok | {:error, Error.t()}
  def check_calls(opts) do
    check(opts,
      reply_spin_us:
        {"a non-negative integer (us), at most 1000",
         &(is_integer(&1) and &1 >= 0 and &1 <= 1_000)}
    )
  end

  @doc """
  Checks `:python`, `:args`, `:env` and `:cd`, what the Python process is
  started with: each a string the OS can take (a binary or charlist, no NUL
  byte), `:args` a list of them, `:env` a list or map of `{name, value}`
  (a name is not empty and has no `=`; a `nil` value unsets the variable).

  ## Examples

      iex> VllmBridge.Worker.Options.check_spawn(args: ["--exports", "m:table"], env: %{"A" => nil})
      :ok

      iex> {:error, error} = VllmBridge.Worker.Options.check_spawn(env: :debug)
      iex> error.message
      ":env must be a list or map of {name, value} strings, got :debug"
  """
  @spec check_spawn(keyword()) :: :ok | {:error, Error.t()}
  def check_spawn(opts) do
    check(opts,
      python:
        {"a non-empty string (a path or a command name)", &(text?(&1) and &1 not in ["", []])},
      args:
        {"a list of strings",
         &(is_list(&1) and proper?(&1) and Enum.all?(&1, fn a -> text?(a) end))},
      env: {"a list or map of {name, value} strings", &env?/1},
      cd: {"a string (a directory)", &text?/1}
    )
  end

  @doc """
  Checks the options `VllmBridge.Pool.start_link/1` adds to a worker's:
  `:name`, `:size`, `:timeout`, `:startup_timeout`, `:max_restarts` and
  `:max_seconds`.

  ## Examples

      iex> {:error, error} = VllmBridge.Worker.Options.check_pool(size: 0)
      iex> error.message
      ":size must be a positive integer, got 0"
  """
  @spec check_pool(keyword()) :: :ok | {:error, Error.t()}
  def check_pool(opts) do
    check(opts,
      name: {"an atom other than nil", &(is_atom(&1) and &1 != nil)},
      size: {"a positive integer", &positive?/1},
      timeout: {"ms (at most #{@longest_ms}) or :infinity", &timeout?(&1, 0)},
      startup_timeout:
        {"a positive integer (ms, at most #{@longest_ms}) or :infinity", &timeout?(&1, 1)},
      max_restarts: {"a non-negative integer", &(is_integer(&1) and &1 >= 0)},
      max_seconds: {"a positive integer (s)", &positive?/1}
    )
  end

  defp positive?(value), do: is_integer(value) and value > 0

  # A string the OS can take: valid UTF-8 (or a charlist of characters), no NUL.
  defp text?(value) when is_binary(value),
    do: String.valid?(value) and not String.contains?(value, <<0>>)

  defp text?(value) when is_list(value) do
    case proper?(value) and :unicode.characters_to_binary(value) do
      binary when is_binary(binary) -> text?(binary)
      _ -> false
    end
  rescue
    ArgumentError -> false
  end

  defp text?(_value), do: false

  # (length/1 fails the guard, so the clause, on an improper list)
  defp proper?(list) when is_list(list) and length(list) >= 0, do: true
  defp proper?(_list), do: false

  # What Worker.Command.env/1 takes: names and values go through to_string/1,
  # so atoms and integers pass too; a name is not empty and has no "=".
  defp env?(env) when is_map(env), do: env?(Map.to_list(env))

  defp env?(env) when is_list(env) do
    proper?(env) and
      Enum.all?(env, fn
        {name, value} -> env_name?(name) and (value == nil or env_text?(value))
        _ -> false
      end)
  end

  defp env?(_env), do: false

  defp env_name?(name) do
    if env_text?(name) do
      text = to_string(name)
      text != "" and not String.contains?(text, "=")
    else
      false
    end
  end

  defp env_text?(value) when is_atom(value) and value not in [nil, true, false],
    do: text?(Atom.to_string(value))

  defp env_text?(value) when is_integer(value), do: true
  defp env_text?(value), do: text?(value)

  # The first of `checks` (in their order) that a given option fails.
  defp check(opts, checks) do
    Enum.find_value(checks, :ok, fn {key, {what, valid?}} ->
      case Keyword.fetch(opts, key) do
        {:ok, value} ->
          unless valid?.(value) do
            {:error,
             Error.new(:bad_args, "#{inspect(key)} must be #{what}, got #{inspect(value)}",
               details: %{key => value}
             )}
          end

        :error ->
          nil
      end
    end)
  end
end
