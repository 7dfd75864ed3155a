//! The elaborator's name scopes: top-level lets, and the nested scopes of blocks, loop
//! variables and template params.
//!
//! Takes bindings as statements run; gives the innermost visible value of a name.
//! Guarantees the language's scoping: an inner binding shadows an outer one, a block's
//! bindings end with it, a `let` again in the same scope replaces the earlier value, and a
//! template body sees the top level and its own params, never its caller's locals.
//!
//! Unrolling binds a loop variable per iteration and looks names up per expression, a few
//! million times for a real-size schedule, so the nested scopes are one stack of bindings
//! (no map, no allocation per iteration once the stack has grown, names borrowed from the
//! AST where they can be) searched from the top; they hold a handful of names. The top
//! level, which may hold many lets, is a map.

use super::value::Val;
use std::borrow::Cow;

pub(super) use crate::ir::FastMap;

/// A [`FastMap`] with no entries.
pub(super) fn fast_map<K, V>() -> FastMap<K, V> {
    FastMap::default()
}

/// Every binding in scope while elaborating.
pub(super) struct Scopes<'a> {
    /// Scope 0: the top-level lets.
    top: FastMap<String, Val>,
    /// The nested scopes' bindings, innermost last.
    locals: Vec<(Cow<'a, str>, Val)>,
    /// Where each open nested scope starts in `locals`.
    starts: Vec<usize>,
    /// Lookups see `locals[floor..]` (then the top level): a template call raises it to
    /// hide its caller's locals.
    floor: usize,
}

impl<'a> Scopes<'a> {
    /// No bindings.
    pub(super) fn new() -> Self {
        Scopes {
            top: fast_map(),
            locals: Vec::new(),
            starts: Vec::new(),
            floor: 0,
        }
    }

    /// The innermost visible binding of `name`.
    pub(super) fn get(&self, name: &str) -> Option<&Val> {
        // Most names are a letter or two: their first byte and length settle most
        // comparisons without a call to compare the bytes.
        let first = name.as_bytes().first();
        self.locals[self.floor..]
            .iter()
            .rev()
            .find(|(n, _)| n.len() == name.len() && n.as_bytes().first() == first && n == name)
            .map(|(_, v)| v)
            .or_else(|| self.top.get(name))
    }

    /// Binds `name` in the innermost scope (the top level when none is open), replacing a
    /// binding of the same name made in that scope.
    pub(super) fn bind(&mut self, name: Cow<'a, str>, value: Val) {
        let Some(&start) = self.starts.last() else {
            self.top.insert(name.into_owned(), value);
            return;
        };
        match self.locals[start..].iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.locals.push((name, value)),
        }
    }

    /// Opens a nested scope.
    pub(super) fn push(&mut self) {
        self.starts.push(self.locals.len());
    }

    /// Closes the innermost nested scope and its bindings.
    pub(super) fn pop(&mut self) {
        if let Some(start) = self.starts.pop() {
            self.locals.truncate(start);
        }
    }

    /// Opens a template body's scope: only the top level and what is bound from now on
    /// are visible until [`Scopes::leave_template`] with the returned value.
    pub(super) fn enter_template(&mut self) -> usize {
        let caller = self.floor;
        self.floor = self.locals.len();
        self.push();
        caller
    }

    /// Closes the scope [`Scopes::enter_template`] opened; `caller` is what it returned.
    pub(super) fn leave_template(&mut self, caller: usize) {
        self.pop();
        self.floor = caller;
    }

    /// Every name bound anywhere (visible or not), for "did you mean" suggestions.
    pub(super) fn names(&self) -> impl Iterator<Item = &str> {
        self.top
            .keys()
            .map(String::as_str)
            .chain(self.locals.iter().map(|(n, _)| n.as_ref()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inner_bindings_shadow_and_end_with_their_scope() {
        let mut scopes = Scopes::new();
        scopes.bind("n".into(), Val::Int(1));
        scopes.push();
        scopes.bind("n".into(), Val::Int(2));
        scopes.bind("n".into(), Val::Int(3));
        assert_eq!(scopes.get("n"), Some(&Val::Int(3)));
        scopes.pop();
        assert_eq!(scopes.get("n"), Some(&Val::Int(1)));
        assert_eq!(scopes.names().count(), 1);
    }

    #[test]
    fn a_template_sees_the_top_level_and_its_params_only() {
        let mut scopes = Scopes::new();
        scopes.bind("top".into(), Val::Int(0));
        scopes.push();
        scopes.bind("caller".into(), Val::Int(1));
        let caller = scopes.enter_template();
        scopes.bind("param".into(), Val::Int(2));
        assert_eq!(scopes.get("caller"), None);
        assert_eq!(scopes.get("top"), Some(&Val::Int(0)));
        assert_eq!(scopes.get("param"), Some(&Val::Int(2)));
        scopes.leave_template(caller);
        assert_eq!(scopes.get("caller"), Some(&Val::Int(1)));
        assert_eq!(scopes.get("param"), None);
    }
}
