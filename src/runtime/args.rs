//! A task's resolved arguments, looked up by role: what every backend's ops read.
//!
//! Takes each argument of a task with the backend's view of its bytes; gives the first or
//! every argument of a role (`w` and `a` may be lists), or [`MissingArg`] naming the role.
//! Backend-neutral: the view type is the backend's.

use crate::ir::Role;
use crate::lower::PlanArg;

/// An argument the op needs is absent (the checker proves it is not; a backend reports it
/// rather than reading nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("missing `{0}` argument")]
pub struct MissingArg(pub &'static str);

/// The arguments of one task with their views, in argument order.
#[derive(Debug)]
pub struct TaskArgs<V> {
    views: Vec<(PlanArg, V)>,
}

impl<V: Copy> TaskArgs<V> {
    /// The arguments and their views, in the task's order.
    pub fn new(views: Vec<(PlanArg, V)>) -> Self {
        TaskArgs { views }
    }

    /// Every argument with its view.
    pub fn iter(&self) -> impl Iterator<Item = &(PlanArg, V)> {
        self.views.iter()
    }

    /// The first argument of role `role`, if the task passes one.
    pub fn get(&self, role: Role) -> Option<V> {
        self.views
            .iter()
            .find(|(a, _)| a.role == role)
            .map(|(_, v)| *v)
    }

    /// The first argument of role `role`, or the error naming it.
    pub fn need(&self, role: Role) -> Result<V, MissingArg> {
        self.get(role).ok_or(MissingArg(role.as_str()))
    }

    /// Every argument of role `role`, in argument order.
    pub fn all(&self, role: Role) -> Vec<V> {
        self.views
            .iter()
            .filter(|(a, _)| a.role == role)
            .map(|(_, v)| *v)
            .collect()
    }
}
