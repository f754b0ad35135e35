defmodule VllmBridge.Worker.Options do
  @moduledoc """
  Checks of the options of `VllmBridge.Worker.start_link/1` that must be
  valid before a worker starts: the health-check timings and the lifecycle
  limits. Each check looks only at the options it names, and only when they
  are given (a missing one takes its valid default).

  The results are `:ok` or `{:error, %VllmBridge.Error{category: :bad_args}}`
  whose message names the option, the kind of value it takes and the value
  it got, e.g. `":max_calls must be a positive integer or nil, got 0"`.
  """

  alias VllmBridge.Error

  @doc """
  Checks `:health_interval` and `:health_timeout`.

  ## Examples

      iex> VllmBridge.Worker.Options.check_health(health_interval: 1_000, other: :ignored)
      :ok
  """
  @spec check_health(keyword()) :: :ok | {:error, Error.t()}
  def check_health(opts) do
    check(opts,
      health_interval: {"a positive integer (ms) or false", &(positive?(&1) or &1 == false)},
      health_timeout: {"a positive integer (ms)", &positive?/1}
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
      backoff_min: {"a positive integer (ms)", &positive?/1},
      backoff_max: {"a positive integer (ms)", &positive?/1}
    )
  end

  defp positive?(value), do: is_integer(value) and value > 0

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
