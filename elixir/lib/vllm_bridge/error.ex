defmodule VllmBridge.Error do
  @moduledoc """
  Why a bridge call failed, as data.

  Every public function of the runtime returns `{:ok, value}` or
  `{:error, %VllmBridge.Error{}}`; nothing raises for bad input. The struct is
  also an exception, so code that prefers to crash can `raise error`.

  ## Categories

  The list is `proto/error_categories.txt`, beside the wire schema (generated
  into `VllmBridge.Proto.Schema`). Seven categories come only from a Python
  worker (see `docs/protocol.md`):

    * `:protocol` - a frame, envelope or value could not be decoded
    * `:not_found` - unknown handle, a released one, or one of another session
    * `:not_exported` - a name the worker's export table does not list
    * `:bad_args` - arguments that do not fit (also: invalid options on the
      Elixir side, which are refused before anything is sent)
    * `:encode` - a value that cannot cross the wire (either direction)
    * `:python` - the Python call raised; see `:python_type` and
      `:python_traceback`
    * `:busy` - the call was not run: every thread of the worker but its
      reader is blocked in a call (a barrier, a recv); it is safe to retry
      once one of them returns

  One comes from either side:

    * `:timeout` - the caller's deadline passed. From the worker: the call
      was not run (its turn came too late), or a wait in it (a `recv_obj`,
      a barrier) gave up at the deadline, and `:python_type` names the
      exception. From the runtime: no reply by the deadline (the late reply
      is dropped)

  Two are added by the Elixir runtime and never come from a worker:

    * `:worker` - the worker process died, is restarting, or the pool does not
      exist
    * `:stale_ref` - a ref names a worker that is no longer the one running at
      its place in the pool, so the object it named is gone

  `:details` is a map with more context: for worker errors it is the msgpack
  map the worker sent (string keys), for runtime errors it holds atom keys such
  as `:term` or `:handle`.
  """

  # The one list, proto/error_categories.txt, generated into VllmBridge.Proto.Schema.
  @categories VllmBridge.Proto.Schema.categories()

  @typedoc "The failure class; see the module documentation."
  @type category :: VllmBridge.Proto.Schema.category()

  @type t :: %__MODULE__{
          category: category(),
          message: String.t(),
          python_type: String.t() | nil,
          python_traceback: String.t() | nil,
          details: map()
        }

  defexception category: :python,
               message: "",
               python_type: nil,
               python_traceback: nil,
               details: %{}

  @doc """
  Returns the categories an error may have.
  """
  @spec categories() :: [category()]
  def categories, do: @categories

  @doc """
  Builds an error.

  ## Options

    * `:details` - a map of context (default `%{}`)
    * `:python_type`, `:python_traceback` - for errors raised in Python

  ## Examples

      iex> VllmBridge.Error.new(:timeout, "no reply within 5000 ms").category
      :timeout
  """
  @spec new(category(), String.t(), keyword()) :: t()
  def new(category, message, opts \\ []) when category in @categories and is_binary(message) do
    %__MODULE__{
      category: category,
      message: message,
      python_type: Keyword.get(opts, :python_type),
      python_traceback: Keyword.get(opts, :python_traceback),
      details: Keyword.get(opts, :details, %{})
    }
  end

  @doc """
  Converts the `error` member of a decoded `Reply` (see
  `VllmBridge.Proto.decode_reply/1`) into an error.

  The category string becomes one of the known atoms (an unknown category
  becomes `:protocol`, with the original string under `"category"` in
  `:details`); empty `python_type`/`traceback` become `nil`; `details`, when
  not empty, is decoded from msgpack (if that fails, the raw bytes are kept
  under `"raw"`).

  ## Examples

      iex> err = VllmBridge.Error.from_reply(%{category: "python", message: "boom",
      ...>   python_type: "RuntimeError", traceback: "Traceback ...", details: ""})
      iex> {err.category, err.python_type}
      {:python, "RuntimeError"}
  """
  @spec from_reply(map()) :: t()
  def from_reply(%{} = reply_error) do
    raw_category = Map.get(reply_error, :category, "")

    details =
      case Map.get(reply_error, :details, "") do
        "" ->
          %{}

        bytes when is_binary(bytes) ->
          case VllmBridge.Msgpack.decode(bytes) do
            {:ok, %{} = map} -> map
            {:ok, other} -> %{"value" => other}
            {:error, _} -> %{"raw" => bytes}
          end
      end

    {category, details} =
      case category_from_string(raw_category) do
        nil -> {:protocol, Map.put(details, "category", raw_category)}
        atom -> {atom, details}
      end

    %__MODULE__{
      category: category,
      message: Map.get(reply_error, :message, ""),
      python_type: blank_to_nil(Map.get(reply_error, :python_type, "")),
      python_traceback: blank_to_nil(Map.get(reply_error, :traceback, "")),
      details: details
    }
  end

  for category <- @categories do
    defp category_from_string(unquote(Atom.to_string(category))), do: unquote(category)
  end

  defp category_from_string(_), do: nil

  defp blank_to_nil(""), do: nil
  defp blank_to_nil(value), do: value

  @impl true
  def message(%__MODULE__{category: category, message: message, python_type: nil}) do
    "(#{category}) #{message}"
  end

  def message(%__MODULE__{} = error) do
    base = "(#{error.category}) #{typed(error.python_type, error.message)}"

    case error.python_traceback do
      nil -> base
      traceback -> base <> "\n\n" <> traceback
    end
  end

  # A Python worker's message usually starts with the exception's type already
  # ("ValueError: 5 is not divisible by 2"): name the type once.
  defp typed(type, message) do
    if message == type or String.starts_with?(message, type <> ":"),
      do: message,
      else: type <> ": " <> message
  end
end
