defmodule VllmBridge.Worker.Owners do
  @moduledoc """
  Which processes own the refs of one worker, as data: for each owner, its
  monitor and how many holds it has on each handle.

  The worker's Python process counts every time it hands a handle out (see
  "Lifetime" in `VllmBridge.Ref`); each of those holds belongs to the process
  that the call's ref was made for. When an owner exits, the
  `VllmBridge.Worker.Server` takes all of its holds from here (`take/2`) and
  gives them back to Python in one release per session; `disown/3` takes
  some of them for `VllmBridge.Runtime.release/2`. So every hold is given
  back once: by its owner's exit or by a release, never by both.

  This module only keeps the table; the server monitors the owners.
  """

  @typedoc "A handle in its session: `{session, handle}`."
  @type key :: {String.t(), non_neg_integer()}

  @typedoc "Each owner's monitor and its holds per handle."
  @opaque t :: %{pid() => {reference(), %{key() => pos_integer()}}}

  @doc "An empty table."
  @spec new() :: t()
  def new, do: %{}

  @doc """
  Adds one hold of `owner` per id in `ids` (handles of `session`). For an
  owner not yet in the table, `monitor` is called for its monitor reference.
  """
  @spec add(t(), pid(), String.t(), [non_neg_integer()], (() -> reference())) :: t()
  def add(owners, owner, session, ids, monitor) do
    {ref, holds} =
      case owners do
        %{^owner => entry} -> entry
        %{} -> {monitor.(), %{}}
      end

    holds = Enum.reduce(ids, holds, &Map.update(&2, {session, &1}, 1, fn n -> n + 1 end))
    Map.put(owners, owner, {ref, holds})
  end

  @doc """
  Takes every hold of `owner` (which exited): its handles by session, each
  handle as many times as it was held, and the table without the owner.
  """
  @spec take(t(), pid()) :: {%{String.t() => [non_neg_integer()]}, t()}
  def take(owners, owner) do
    case Map.pop(owners, owner) do
      {nil, owners} ->
        {%{}, owners}

      {{_ref, holds}, owners} ->
        by_session =
          Enum.reduce(holds, %{}, fn {{session, id}, n}, acc ->
            Map.update(acc, session, List.duplicate(id, n), &(List.duplicate(id, n) ++ &1))
          end)

        {by_session, owners}
    end
  end

  @doc """
  Takes the holds of each `{owner, id}` pair on handles of `session`: the
  handles, each as many times as its owner held it (none when it holds
  none), the monitors of the owners that hold nothing any more, and the
  table without those holds.
  """
  @spec disown(t(), String.t(), [{pid(), non_neg_integer()}]) ::
          {[non_neg_integer()], [reference()], t()}
  def disown(owners, session, pairs) do
    Enum.reduce(pairs, {[], [], owners}, fn {owner, id}, {ids, done, owners} = acc ->
      with {ref, holds} <- Map.get(owners, owner),
           {n, holds} when is_integer(n) <- Map.pop(holds, {session, id}) do
        ids = List.duplicate(id, n) ++ ids

        if map_size(holds) == 0,
          do: {ids, [ref | done], Map.delete(owners, owner)},
          else: {ids, done, Map.put(owners, owner, {ref, holds})}
      else
        _ -> acc
      end
    end)
  end

  @doc "How many processes own refs here."
  @spec count(t()) :: non_neg_integer()
  def count(owners), do: map_size(owners)
end
